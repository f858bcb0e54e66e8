"""torch's own DDP communication hooks as strategies (``torch_fp16``, ``torch_powersgd``):
Lightning's ``DDPStrategy`` with ``ddp_comm_hook`` / ``ddp_comm_state`` set from a validated
``HookConfig`` -- the peers a user of torch would otherwise pick, trainable with the same
recipes as ours. No ``SyncplaneStrategy`` hooks: DDP's reducer does the averaging."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from syncplane.algorithms.torch_hooks import HookConfig
from syncplane.algorithms.torch_hooks.hooks import metered
from syncplane.algorithms.replicas import CommMeter
from syncplane.strategies.base import Watched
from syncplane.strategies.registry import register


class TorchHookStrategy(Watched, DDPStrategy):
    """Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` on CUDA only (a torch 1.8
    restriction, its comment says) and silently drops it on CPU; torch's hooks run on gloo
    today (``tests/dist/test_torch_hooks.py``), so the hook is not handed to Lightning: it is
    registered (torch's ``register_comm_hook``) once ``configure_ddp`` has wrapped the model, on
    any device.

    The hook is registered metered (``comm_meter``: each bucket from launch to completion,
    and the bytes the hook really sends), because DDP takes one comm hook only: the run
    report, which meters plain DDP with a hook of its own, reads this meter instead."""

    config: HookConfig

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("ddp_comm_hook") is not None or kwargs.get("ddp_comm_wrapper") is not None:
            raise ValueError(f"{self.config.name}: its comm hook is torch's, set by the strategy; "
                             "ddp_comm_hook and ddp_comm_wrapper cannot be set")
        super().__init__(**kwargs)
        self.comm_meter = CommMeter()
        self.hook_state, self.hook = self.config.hook()

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()   # wraps the model in DDP; Lightning was given no hook to register
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self.hook_state, metered(self.hook, self.config, self.comm_meter,
                                                               self.world_size))


@register("torch_fp16")
class TorchFp16Strategy(TorchHookStrategy):
    """DDP whose gradient buckets are all-reduced in fp16 (torch's ``fp16_compress_hook``).
    Args: ``DDPStrategy``'s."""

    def __init__(self, **kwargs: Any) -> None:
        self.config = HookConfig(name="torch_fp16")
        super().__init__(**kwargs)


@register("torch_powersgd")
class TorchPowerSGDStrategy(TorchHookStrategy):
    """DDP with torch's ``powerSGD_hook``. Args: those of ``HookConfig`` (the rank, when
    compression starts, ...), then ``DDPStrategy``'s."""

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 2,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 **kwargs: Any) -> None:
        self.config = HookConfig(name="torch_powersgd", matrix_approximation_rank=matrix_approximation_rank,
                                 start_powerSGD_iter=start_powerSGD_iter, min_compression_rate=min_compression_rate,
                                 use_error_feedback=use_error_feedback, warm_start=warm_start)
        super().__init__(**kwargs)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # torch's PowerSGDState holds a numpy RNG (no weights_only load) and bucket-indexed
        # matrices for a layout DDP rebuilds after each process's first backward
        rank_zero_warn("torch_powersgd: Lightning's DDPStrategy saves no comm-hook state, so this resume starts "
                       f"PowerSGD over ({self.config.start_powerSGD_iter} uncompressed steps, then fresh low-rank and "
                       "error-feedback state): it does not continue the interrupted run bit-identically")
        return super().load_checkpoint(checkpoint_path, weights_only)
