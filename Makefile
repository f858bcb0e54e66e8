# The two commands a newcomer needs (README):  make run   |   make test
PYTHON ?= python3
STAMP := build/.installed

.PHONY: setup run test lint bench-kernels scoreboard scoreboard-tables results figures compare-pngs lm-headline clean

# Install the package (editable) with its extras, then compile the C++ kernels once.
# Re-runs only when pyproject.toml changes; `make setup -B` forces it.
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -e ".[dev,vision,nlp,ft,wandb]"
	@# Real Fashion-MNIST for the fashion_mnist recipe, from Debian when apt (as root) has it;
	@# optional: without it the recipe needs recipe.data_dir, and the tests make their own IDX files.
	-@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& apt-cache policy dataset-fashion-mnist 2>/dev/null | grep -q 'Candidate: [0-9]'; then \
		apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
		|| echo "note: apt-get could not install dataset-fashion-mnist (optional; see docs/recipes.md)"; fi
	$(PYTHON) -m syncplane build-ext
	@mkdir -p build && touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PYTHON) train.py

# Two pytest workers: half the suite's time is its jobs waiting (heartbeats, slow emulated links),
# which a second worker fills (docs/design-notes.md). TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
test: setup
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist worksteal

# The layer contracts (import-linter) and the no-import-cycle check.
lint: setup
	$(PYTHON) scripts/lint_imports.py

bench-kernels: setup
	$(PYTHON) scripts/bench_kernels.py

# The scoreboard (docs/matrix/, the grid atop docs/benchmarks.md): every strategy on every shipped profile at the
# ResNet-50 payload, each profile one emulated run with ddp beside, 3 timed steps a strategy after
# one untimed (root; about 2.5 hours on 2 cores, 2026-11-30).
# Resumable: run it again after an interruption and only the missing cells run.
# SCOREBOARD_ARGS narrows it, e.g. SCOREBOARD_ARGS="--clusters two_racks --strategies ddp,atc".
SCOREBOARD_DIR ?= docs/matrix
SCOREBOARD_PAYLOAD ?= resnet50
scoreboard: setup
	$(PYTHON) -m syncplane bench --matrix --payload-mb $(SCOREBOARD_PAYLOAD) --steps 3 --warmup 1 --out $(SCOREBOARD_DIR) $(SCOREBOARD_ARGS)
	$(PYTHON) scripts/scoreboard.py $(SCOREBOARD_DIR)
	$(PYTHON) scripts/results.py

# The tables and charts again from the matrix's JSON, without running anything.
scoreboard-tables:
	$(PYTHON) scripts/scoreboard.py $(SCOREBOARD_DIR)
	$(PYTHON) scripts/results.py

# Every published figure again from the committed JSON (docs/benchmarks.md, the guides' generated
# blocks, docs/reference/): seconds, nothing runs. `scripts/results.py --check` says what is stale.
results:
	$(PYTHON) scripts/results.py

# The published scoreboard charts (docs/matrix/<profile>.png and docs/matrix/8mb/: vs DDP, bound
# ratio, model error per strategy) again from their committed JSON, without running anything (seconds).
figures:
	$(PYTHON) scripts/scoreboard.py docs/matrix --png-only
	$(PYTHON) scripts/scoreboard.py docs/matrix/8mb --png-only

# The published training comparisons (docs/compare/*/comparison.{json,md,png}) again, with the
# command docs/benchmarks.md gives: one compare per seed, then merged (training; hours). Their
# charts need the runs' histories, which are not committed: only this redraws them.
# compare/two_racks has no chart: its canary and atc rows are superseded (meta.replaced_by in its JSON).
COMPARE_STRATEGIES ?= ddp,torchft_diloco,diloco,atc,h_atc,ds_sync,flexreduce,canary,horovod
compare-pngs: setup
	for cluster in two_racks wan_two_sites; do for seed in 1 2 3; do \
		$(PYTHON) -m syncplane compare --cluster $$cluster --recipe fashion_mnist_wide \
			--strategies $(COMPARE_STRATEGIES) --target-acc 0.8 --seeds $$seed \
			--out outputs/compare/$$cluster-s$$seed trainer.max_epochs=3 || exit 1; done; \
		$(PYTHON) scripts/compare.py outputs/compare/$$cluster-s1 outputs/compare/$$cluster-s2 \
			outputs/compare/$$cluster-s3 --out docs/compare/$$cluster --target-acc 0.8 || exit 1; done

# Issue 78's headline: tiny_lm across the wan_nodes WAN (root: an emulated cluster), ddp priced,
# every DiLoCo row (replica=node; fp32 blocking, fp32/int8/sparse overlapped, Muon at H = 50 and 100) timed
# end to end, 3 seeds for ddp and the best rows; writes docs/results/lm_wan.json and its two charts.
# Resumable: run it again and only missing runs run. LM_HEADLINE_ARGS narrows it, e.g.
# LM_HEADLINE_ARGS="--quick --rows ddp,diloco_fp32_blocking".
LM_HEADLINE_ARGS ?= --seeds 1 --seeds-for ddp=3,diloco_muon=3,diloco_int8_overlap=3,diloco_muon_h100=3
lm-headline: setup
	$(PYTHON) scripts/lm_wan.py $(LM_HEADLINE_ARGS)

clean:
	rm -rf build outputs multirun .pytest_cache
