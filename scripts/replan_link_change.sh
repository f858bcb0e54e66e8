#!/bin/bash
# strategy=auto re-planning on an emulated cluster whose network changes mid-run
# (docs/design-notes.md, "Re-planning while training"). Run as root, under the emulator lock:
#   flock /tmp/syncplane-netns.lock scripts/replan_link_change.sh RUN_DIR
# SCENARIO picks the change:
#   flow_cap (default): a pair of 1,000 Mbit hosts, DiLoCo only; every flow is then capped at 10 Mbit.
#   uplink_drop: two racks of two one-rank hosts (1,000 Mbit NICs and uplinks), the exact class
#     (ddp, flexreduce); both uplinks then drop to 100 Mbit.
# NAMED=<strategy> runs that strategy as named instead of strategy=auto (the baseline to compare
# with: same network, same change, no re-planning). STEPS (default 110) and CAP_AFTER (seconds
# after the start-up decision, default 15) tune it. It ends with the switches summary.json
# records and the mean step of each epoch (history.jsonl).
set -u
RUN=${1:?usage: replan_link_change.sh RUN_DIR}
export SYNCPLANE_EMULATOR_PREFIX=${SYNCPLANE_EMULATOR_PREFIX:-rpl-}
export SCENARIO=${SCENARIO:-flow_cap}
mkdir -p "$(dirname "$RUN")"
PROFILE=$RUN.profile.yaml
case "$SCENARIO" in
  flow_cap)
    DEVICES=2
    AUTO=(strategy.kwargs.accept=approximate 'strategy.kwargs.strategies=[diloco]' strategy.kwargs.period=5
          strategy.kwargs.compute_ms=1)
    cat > "$PROFILE" <<'YAML'
name: pair_1g
racks:
  - name: r0
    hosts:
      - {name: h0, nic_mbit: 1000, ranks: 1}
      - {name: h1, nic_mbit: 1000, ranks: 1}
YAML
    ;;
  uplink_drop)
    DEVICES=4
    AUTO=('strategy.kwargs.strategies=[ddp,flexreduce]' strategy.kwargs.compute_ms=20)
    cat > "$PROFILE" <<'YAML'
name: two_racks_1g
racks:
  - name: r0
    uplink_mbit: 1000
    hosts:
      - {name: a0, nic_mbit: 1000, ranks: 1}
      - {name: a1, nic_mbit: 1000, ranks: 1}
  - name: r1
    uplink_mbit: 1000
    hosts:
      - {name: b0, nic_mbit: 1000, ranks: 1}
      - {name: b1, nic_mbit: 1000, ranks: 1}
YAML
    ;;
  *) echo "SCENARIO: flow_cap or uplink_drop, got $SCENARIO" >&2; exit 2 ;;
esac
if [ -n "${NAMED:-}" ]; then
  STRATEGY=(strategy="$NAMED")
else
  STRATEGY=(strategy=auto "${AUTO[@]}" strategy.kwargs.replan_every_s=5)
fi
python3 train.py "${STRATEGY[@]}" cluster="$PROFILE" trainer.devices=$DEVICES recipe.width=256 \
  trainer.max_steps="${STEPS:-110}" hydra.run.dir="$RUN" > "$RUN.log" 2>&1 &
PID=$!
# the change comes CAP_AFTER seconds after the training starts (rank 0's heartbeat line)
for i in $(seq 300); do grep -qs "heartbeat: every" "$RUN/logs/rank0.log" && break; sleep 1; done
echo "training after ${i}s"; sleep "${CAP_AFTER:-15}"
python3 - <<'PY'
import os
import subprocess
from syncplane.cluster import emulator

switch = emulator.switch_namespace()
if os.environ["SCENARIO"] == "flow_cap":    # both ends of each NIC: every flow at 10 Mbit
    links = [(ns, dev, 1000, 10) for i, host in enumerate(("h0", "h1"))
             for ns, dev in ((emulator.host_namespace(host), "eth0"), (switch, f"hp{i}n0"))]
else:                                       # each uplink, both directions: 100 Mbit
    links = [(switch, f"upl{r}{end}", 100, None) for r in range(2) for end in "rc"]
for ns, dev, mbit, per_flow in links:
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=True)
    emulator.shape(ns, dev, mbit, per_flow_mbit=per_flow)
print(f"{os.environ['SCENARIO']}: shaped {', '.join(dev for _, dev, _, _ in links)}")
PY
wait $PID; RC=$?; echo "train.py exited $RC"
grep -h "re-planned" "$RUN.log" "$RUN/logs/rank0.log" 2>/dev/null | sort -u
python3 -m syncplane emulate down
python3 - "$RUN" <<'PY'
import json, sys
run = sys.argv[1]
summary = json.load(open(f"{run}/summary.json"))
replans = summary["strategy_details"].get("auto", {}).get("replans", [])
print(f"{summary['strategy']}: {len(replans)} switch(es):",
      [(r["step"], r["current"]["label"], r["best"]["label"]) for r in replans])
steps = 0
for line in open(f"{run}/history.jsonl"):
    epoch = json.loads(line)
    n, steps = epoch["step"] - steps, epoch["step"]
    print(f"epoch {epoch['epoch']}: {n} steps, {epoch['epoch_s'] / n:.3f} s/step, val_acc {epoch.get('val_acc', 0):.3f}")
PY
exit $RC
