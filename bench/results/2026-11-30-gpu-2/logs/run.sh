#!/usr/bin/env bash
# Second GPU run: the failing tests with tracebacks, accuracy, the headline scan figures with kernel time.
export PYTHONPATH=$PWD/.peers PYTHONUNBUFFERED=1
R=/tmp/r2; mkdir -p $R
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 110 python3 -m pytest -p no:cacheprovider -q -rfE --tb=short tests/test_scan_exactness.py \
  "tests/test_chunked.py::test_variants" tests/test_chunked.py::test_softplus_extremes \
  tests/test_scan_accuracy.py::test_mamba2_variants > $R/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" $R/pytest.log | tail -25
timeout 40 python3 -m bench.accuracy > $R/accuracy.log 2>&1; echo "accuracy rc=$?"; tail -12 $R/accuracy.log
timeout 190 python3 -m bench.scan --sections scan,captures --seqlens 2048 8192 32768 --time-budget 150 --out $R/scan > $R/scan.log 2>&1
echo "scan rc=$?"
tar -C /tmp -czf $OUT/r2.tgz r2
grep -v "^\s*$" $R/scan.log | grep -v "skipped *skipped" | tail -60
