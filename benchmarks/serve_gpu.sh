#!/usr/bin/env bash
# Serve the full-size model on the GPU machine behind Ray Serve and load it with Locust, in one call (< 9 min).
#
#   eval "$(bash .devbundle/install.sh)" && bash benchmarks/serve_gpu.sh          # results in $OUT
#
# Steps: ray start (loopback, no dashboard) -> serve.start() with the config's http_options and logging_config
# (so the proxy's access log is off too; `serve run` alone would leave it on) -> `serve run --address ...
# serve_configs/local_gpu.yaml` in the background (full-size sam3, bf16, random weights unless SAMMIE_CHECKPOINT is
# set) -> wait for GET /readyz -> a short Locust warm-up (discarded) -> one headless Locust run per user count
# (--processes, closed loop, 640x480 JPEG photographs, 1 prompt) -> /readyz after each step -> clean shutdown.
#
# Files in $OUT (at most 8, no folders): summary.md (per step: requests/s, images/s, p50/p90/p99, failures, GPU
# utilisation), u<N>_stats.csv (Locust's stats per step), failures.csv (only if a request failed), readyz.jsonl
# (the server's /readyz before and after each step), serve.log (last lines of the server's output).
#
# Knobs (env): CONFIG (serve config, default serve_configs/local_gpu.yaml), USERS ("8 32 64"), STEP_S (40),
# WARMUP_S (10), PROCS (Locust processes, 4), PROMPTS (prompts per request, 1), MASK_FORMAT (rle),
# READY_TIMEOUT_S (360), PORT (8000, must match the config), DIRECT_INGRESS=1 (RAY_SERVE_ENABLE_DIRECT_INGRESS),
# REQUIRE_GPU=0 (skip the CUDA check: a CPU dry run with CONFIG=serve_configs/local.yaml).
# The serving path's ceiling with no model (EngineConfig.null_model) is benchmarks/serve_ceiling.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CONFIG=${CONFIG:-serve_configs/local_gpu.yaml}
USERS=${USERS:-"8 32 64"}
STEP_S=${STEP_S:-40}
WARMUP_S=${WARMUP_S:-10}
PROCS=${PROCS:-4}
PROMPTS=${PROMPTS:-1}
MASK_FORMAT=${MASK_FORMAT:-rle}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-360}
PORT=${PORT:-8000}
HOST=http://127.0.0.1:$PORT
OUT=${OUT:-$ROOT/out/serve_gpu}
mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/sammie_bench.XXXXXX)
T0=$(date +%s)
say() { echo "[serve_gpu +$(( $(date +%s) - T0 ))s] $*"; }

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # absolute: Ray workers must import sammie
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}
export RAY_USAGE_STATS_ENABLED=0   # (the locustfile sets OMP/OPENBLAS threads to 1 for itself)
[ "${DIRECT_INGRESS:-0}" = 1 ] && export RAY_SERVE_ENABLE_DIRECT_INGRESS=1

SP=""
cleanup() {
  if [ -n "$SP" ] && kill -0 "$SP" 2>/dev/null; then
    say "stopping serve run (SIGINT)"
    kill -INT "$SP" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$SP" 2>/dev/null || break; sleep 1; done
    kill -0 "$SP" 2>/dev/null && kill -TERM "$SP" 2>/dev/null
  fi
  [ -n "${GPU_SAMPLER:-}" ] && kill "$GPU_SAMPLER" 2>/dev/null
  ray stop >/dev/null 2>&1 || ray stop --force >/dev/null 2>&1
  [ -f "$TMP/serve.log" ] && tail -n 400 "$TMP/serve.log" > "$OUT/serve.log"
  rm -rf "$TMP"
  say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}
trap cleanup EXIT

for tool in ray serve locust curl python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool: run eval \"\$(bash .devbundle/install.sh)\" first"; exit 2; }
done
python3 -c "import yaml, sammie.serve" || { echo "cannot import yaml / sammie.serve (PYTHONPATH=$PYTHONPATH)"; exit 2; }
locust --version >/dev/null || exit 2
if [ "${REQUIRE_GPU:-1}" = 1 ]; then
  python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('GPU:', torch.cuda.get_device_name(0))" || exit 2
fi

say "ray start"
ray start --head --node-ip-address=127.0.0.1 --port=6379 --include-dashboard=false --disable-usage-stats \
  > "$TMP/ray_start.log" 2>&1 || { cat "$TMP/ray_start.log"; exit 1; }

say "serve.start with $CONFIG's proxy/http/logging options"
python3 - "$CONFIG" <<'EOF' || exit 1
import sys, yaml, ray
from ray import serve
from ray.serve.schema import ServeDeploySchema
cfg = ServeDeploySchema.model_validate(yaml.safe_load(open(sys.argv[1])))
ray.init(address="auto", namespace="serve", log_to_driver=False)
serve.start(proxy_location=cfg.proxy_location, http_options=cfg.http_options.model_dump(),
            logging_config=cfg.logging_config)  # the proxy takes its logging config from here only
print("serve started:", cfg.http_options.host, cfg.http_options.port, "access log:",
      cfg.logging_config.enable_access_log if cfg.logging_config else True)
EOF

say "serve run $CONFIG (background)"
set -m   # a background job of a non-interactive shell ignores SIGINT unless job control is on
serve run --address 127.0.0.1:6379 "$CONFIG" > "$TMP/serve.log" 2>&1 &
SP=$!
set +m

app_status() {  # "<STATUS> <message>" of the first application in the config, from the Serve controller
  python3 - "$CONFIG" <<'PYEOF' 2>/dev/null
import sys, yaml, ray
from ray import serve
name = (yaml.safe_load(open(sys.argv[1]))["applications"][0].get("name")) or "default"
ray.init(address="auto", namespace="serve", log_to_driver=False, logging_level="ERROR")
app = serve.status().applications.get(name)
print(f"{getattr(app.status, 'value', app.status)} {app.message}".replace("\n", " ")[:800] if app else "NOT_FOUND")
PYEOF
}

say "waiting for $HOST/readyz (up to ${READY_TIMEOUT_S}s)"
ready=0
t_wait=$(date +%s); next_check=$(( t_wait + 10 ))
while [ $(( $(date +%s) - t_wait )) -lt "$READY_TIMEOUT_S" ]; do
  if ! kill -0 "$SP" 2>/dev/null; then say "serve run exited"; tail -n 60 "$TMP/serve.log"; exit 1; fi
  code=$(curl -s --max-time 5 -o "$TMP/readyz.json" -w '%{http_code}' "$HOST/readyz" || true)
  if [ "$code" = 200 ]; then ready=1; break; fi
  if [ "$(date +%s)" -ge "$next_check" ]; then   # every 15 s: ask the controller
    next_check=$(( $(date +%s) + 15 ))
    st=$(app_status)
    say "app: ${st:0:300} (readyz: $code)"
    case "$st" in
      *DEPLOY_FAILED*|*UNHEALTHY*|*"failed to start"*)
        say "deployment failed"; tail -n 80 "$TMP/serve.log"; exit 1 ;;
    esac
  fi
  sleep 2
done
[ "$ready" = 1 ] || { say "not ready after ${READY_TIMEOUT_S}s"; tail -n 80 "$TMP/serve.log"; exit 1; }
say "ready: $(head -c 600 "$TMP/readyz.json")"

readyz() {  # append one /readyz snapshot, labelled, to readyz.jsonl
  local body; body=$(curl -s --max-time 10 "$HOST/readyz" || echo null)
  python3 -c 'import json,sys; b=sys.argv[2]
try: b=json.loads(b)
except Exception: pass
print(json.dumps({"when": sys.argv[1], "readyz": b}))' "$1" "$body" >> "$OUT/readyz.jsonl"
}
: > "$OUT/readyz.jsonl"
readyz "start"

LOCUST_ARGS=(-f benchmarks/locustfile.py --headless --host "$HOST" --only-summary --processes "$PROCS"
             --prompts-per-request "$PROMPTS" --mask-format "$MASK_FORMAT" --exit-code-on-error 1 -s 5)

say "warm-up: 8 users, ${WARMUP_S}s (not recorded)"
timeout $(( WARMUP_S + 60 )) locust "${LOCUST_ARGS[@]}" -u 8 -r 8 -t "${WARMUP_S}s" > "$TMP/warmup.log" 2>&1
grep -E "^sammie:" "$TMP/warmup.log" || tail -n 20 "$TMP/warmup.log"

for u in $USERS; do
  say "step: $u users, ${STEP_S}s, $PROCS processes"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 \
      > "$TMP/gpu_u$u.csv" 2>/dev/null & GPU_SAMPLER=$!
  fi
  timeout $(( STEP_S + 60 )) locust "${LOCUST_ARGS[@]}" -u "$u" -r "$u" -t "${STEP_S}s" --csv "$TMP/u$u" \
    > "$TMP/locust_u$u.log" 2>&1
  echo "$?" > "$TMP/rc_u$u"
  [ -n "${GPU_SAMPLER:-}" ] && { kill "$GPU_SAMPLER" 2>/dev/null; wait "$GPU_SAMPLER" 2>/dev/null; GPU_SAMPLER=""; }
  grep -E "^sammie:" "$TMP/locust_u$u.log" || tail -n 20 "$TMP/locust_u$u.log"
  n=$(grep -c "RecursionError" "$TMP/locust_u$u.log"); [ "$n" -gt 0 ] && say "WARNING: $n RecursionError lines (a Locust worker broke)"
  cp "$TMP/u${u}_stats.csv" "$OUT/" 2>/dev/null
  readyz "after $u users"
done

# One failures file for all steps (only when something failed).
python3 - "$TMP" "$OUT" $USERS <<'EOF'
import csv, sys, pathlib
tmp, out, users = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
rows = []
for u in users:
    f = tmp / f"u{u}_failures.csv"
    if f.exists():
        rows += [{"users": u, **r} for r in csv.DictReader(open(f))]
if rows:
    with open(out / "failures.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader(); w.writerows(rows)
EOF

python3 - "$TMP" "$OUT" "$CONFIG" "$PROCS" "$PROMPTS" "$STEP_S" "$MASK_FORMAT" $USERS <<'EOF'
import csv, json, pathlib, statistics, sys, subprocess
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
config, procs, prompts, step_s, fmt, users = sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7], sys.argv[8:]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = "?"
snaps = [json.loads(l) for l in open(out / "readyz.jsonl")]
rw = next((s["readyz"].get("random_weights") for s in snaps if isinstance(s["readyz"], dict)), None)
lines = [
    "# Sammie on Ray Serve: Locust steps", "",
    f"GPU: {gpu}. Config: `{config}`. Locust: {procs} processes, closed loop, {step_s} s per step, one 640x480 "
    f"JPEG + {prompts} prompt(s) per request, mask_format={fmt}. random_weights: {rw}.", "",
    "| users | requests | failures | req/s | images/s | pairs/s | p50 ms | p90 ms | p99 ms | max ms | GPU util % (mean) | GPU mem MiB (max) | locust rc |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]
for u in users:
    f = tmp / f"u{u}_stats.csv"
    rc = (tmp / f"rc_u{u}").read_text().strip() if (tmp / f"rc_u{u}").exists() else "?"
    row = None
    if f.exists():
        row = next((r for r in csv.DictReader(open(f)) if r["Name"] == "/v1/segment"), None)
    if row is None:
        lines.append(f"| {u} | no data | | | | | | | | | | | {rc} |")
        continue
    rps, fps = float(row["Requests/s"]), float(row["Failures/s"])
    util, mem = "", ""
    g = tmp / f"gpu_u{u}.csv"
    if g.exists():
        vals = [l.split(",") for l in g.read_text().split("\n") if l.count(",") == 1]
        try:
            util = f"{statistics.mean(float(a) for a, _ in vals):.0f}"
            mem = f"{max(float(b) for _, b in vals):.0f}"
        except (ValueError, statistics.StatisticsError):
            pass
    lines.append(
        f"| {u} | {row['Request Count']} | {row['Failure Count']} | {rps:.1f} | {rps - fps:.1f} | "
        f"{(rps - fps) * prompts:.1f} | {row['50%']} | {row['90%']} | {row['99%']} | {float(row['Max Response Time']):.0f} | "
        f"{util} | {mem} | {rc} |"
    )
lines += ["", "images/s = (requests/s - failures/s) x 1 image per request; pairs/s = images/s x prompts per request.",
          "Not measured: the serving-path ceiling with a null model (no EngineConfig switch for it yet)."]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "total $(( $(date +%s) - T0 ))s"
