#!/bin/bash
# strategy=auto re-planning on an emulated pair of hosts whose flows start being capped mid-run
# (docs/benchmarks.md, "Re-planning while training"). Run as root, under the emulator lock:
#   flock /tmp/syncplane-netns.lock scripts/replan_link_change.sh RUN_DIR
# STEPS (default 110: five epochs, about 3 min on a loaded 2-core machine) and CAP_AFTER (seconds
# after the start-up decision, default 15) tune it. It ends with the switches summary.json records.
set -u
RUN=${1:?usage: replan_link_change.sh RUN_DIR}
export SYNCPLANE_EMULATOR_PREFIX=${SYNCPLANE_EMULATOR_PREFIX:-rpl-}
mkdir -p "$(dirname "$RUN")"
PROFILE=$RUN.pair.yaml
cat > "$PROFILE" <<'YAML'
name: pair_1g
racks:
  - name: r0
    hosts:
      - {name: h0, nic_mbit: 1000, ranks: 1}
      - {name: h1, nic_mbit: 1000, ranks: 1}
YAML
python3 train.py strategy=auto cluster="$PROFILE" trainer.devices=2 recipe.width=256 \
  strategy.kwargs.accept=approximate 'strategy.kwargs.strategies=[diloco]' strategy.kwargs.period=5 \
  strategy.kwargs.compute_ms=1 strategy.kwargs.replan_every_s=5 trainer.max_steps="${STEPS:-110}" \
  hydra.run.dir="$RUN" > "$RUN.log" 2>&1 &
PID=$!
for i in $(seq 300); do grep -qs "strategy=auto (accept" "$RUN.log" && break; sleep 1; done
echo "decided after ${i}s"; sleep "${CAP_AFTER:-15}"
python3 - <<'PY'
import subprocess
from syncplane.cluster import emulator
switch = emulator.switch_namespace()
for i, host in enumerate(("h0", "h1")):            # both ends of each NIC: every flow at 10 Mbit
    for ns, dev in ((emulator.host_namespace(host), "eth0"), (switch, f"hp{i}n0")):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=True)
        emulator.shape(ns, dev, 1000, per_flow_mbit=10)
print("capped every flow at 10 Mbit")
PY
wait $PID; RC=$?; echo "train.py exited $RC"
grep "re-planned" "$RUN.log"
python3 -m syncplane emulate down
python3 - "$RUN/summary.json" <<'PY'
import json, sys
replans = json.load(open(sys.argv[1]))["strategy_details"]["auto"]["replans"]
print(f"summary.json: {len(replans)} switch(es):", [(r["step"], r["current"]["label"], r["best"]["label"]) for r in replans])
PY
exit $RC
