#!/usr/bin/env bash
# The CUDA half of bench/checkpoint_path.py, for a lent GPU machine (see bench/README.md).
#
# That machine has Python 3.12 with a CUDA build of torch and no package index; the rest of our
# dependencies travel as wheels in .whl/ (bench/README.md says how to fetch them). It installs
# them, gives /dev/shm room for a 4 GiB state held a few times over, runs the bench on CUDA
# tensors and leaves its output and JSON in $OUT (or ./bench/results without $OUT).
set -euo pipefail
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
shm_kb=$(df -k /dev/shm | awk 'NR==2 {print $2}')
if [ "$shm_kb" -lt $((48 * 1024 * 1024)) ]; then
    mount -o remount,size=64g /dev/shm || mount -t tmpfs -o size=64g tmpfs /dev/shm
fi
df -h /dev/shm | tail -1
# The CUDA tests first (tests/test_cuda_staging.py: the side stream, the pinned rotation, a CUDA
# state saved and loaded back); their result is kept whatever it is, and the bench runs after.
set +e
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_staging.py 2>&1 | tee "$OUT/cuda_tests.txt"
echo "cuda tests exit ${PIPESTATUS[0]}" | tee -a "$OUT/cuda_tests.txt"
set -e
python3 bench/checkpoint_path.py --device cuda --sizes "${SIZES:-4096}" --repeats "${REPEATS:-6}" \
    --skip-library --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.txt"
