#!/usr/bin/env bash
# One pass over what poly does on a GPU box, in under 10 minutes: versions, the throughput table (raw EnvPool, the
# acting loop with a free policy, the learner alone, poly itself), a few minutes of training with the defaults and with
# the APPO configuration under study (APPO_FLAGS, docs/experiments.md), and a 2-rank torchrun on the one GPU (ranks that
# share a GPU all-reduce with gloo). Figures go to stdout; runs/ lands in a temporary folder.
#
#     bash benchmarks/gpu_check.sh                       # Breakout-v5, 256 envs, as on the device
#     ENV_ID=CartPole-v1 NUM_ENVS=16 ENTRY_SECONDS=4 TRAIN_SECONDS=30 RANK_STEPS=20000 bash benchmarks/gpu_check.sh  # CPU try-out
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENV_ID=${ENV_ID:-Breakout-v5}
NUM_ENVS=${NUM_ENVS:-256}
ENTRY_SECONDS=${ENTRY_SECONDS:-20}  # each throughput entry (not SECONDS: bash's own clock, 0 at start)
TRAIN_SECONDS=${TRAIN_SECONDS:-150}
RANK_STEPS=${RANK_STEPS:-400000}   # the torchrun leg: total steps over both ranks
APPO_FLAGS=${APPO_FLAGS:-"--replay-proportion 3 --clip-coef 0.1 --learning-rate 7.5e-4"}
PYTHON=${PYTHON:-$(command -v python || command -v python3)}  # many GPU images have python3 alone
WORK=$(mktemp -d)
cd "$WORK"

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
echo "cores: $(nproc)"
"$PYTHON" -c "import torch, envpool; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'envpool', envpool.__version__)"

echo "== throughput: $ENV_ID, $NUM_ENVS envs"
"$PYTHON" "$ROOT/benchmarks/throughput.py" --env-ids "$ENV_ID" --num-envs "$NUM_ENVS" --seconds "$ENTRY_SECONDS" \
    --warmup 30 --scripts impala_poly.py --precisions bf16 2>&1 | grep -v -i warn

echo "== training: impala_poly.py --env-id $ENV_ID --num-envs $NUM_ENVS for $TRAIN_SECONDS s"
timeout -s TERM "$TRAIN_SECONDS" "$PYTHON" "$ROOT/impala_poly.py" --env-id "$ENV_ID" --num-envs "$NUM_ENVS" \
    --total-timesteps 50000000 --run-name single 2>&1 | grep -v -i warn
echo "exit code ${PIPESTATUS[0]} (124: stopped by the time limit, as planned)"

echo "== training, APPO: impala_poly.py --env-id $ENV_ID --num-envs $NUM_ENVS $APPO_FLAGS for $TRAIN_SECONDS s"
# shellcheck disable=SC2086  # APPO_FLAGS is a list of flags
timeout -s TERM "$TRAIN_SECONDS" "$PYTHON" "$ROOT/impala_poly.py" --env-id "$ENV_ID" --num-envs "$NUM_ENVS" \
    --total-timesteps 10000000 --run-name appo $APPO_FLAGS 2>&1 | grep -v -i warn
echo "exit code ${PIPESTATUS[0]} (124: stopped by the time limit, as planned)"

echo "== torchrun: 2 ranks on one GPU, $((NUM_ENVS / 2)) envs each, $RANK_STEPS steps"
torchrun --standalone --nproc-per-node 2 "$ROOT/impala_poly.py" --env-id "$ENV_ID" --num-envs $((NUM_ENVS / 2)) \
    --total-timesteps "$RANK_STEPS" --run-name torchrun 2>&1 | grep -v -i warn | tail -15
echo "exit code ${PIPESTATUS[0]}"
rm -rf "$WORK"
