#!/bin/sh
# Run once the image's packages are installed: what a run never uses leaves the image, so that the CUDA image stays
# within torch plus 1 GB (docs/containers.md) with pyarrow (parquet) in it. Nothing here is imported by the job:
# - the packages' own test suites (directories named tests; `testing` modules, which some import, stay; torch is
#   left whole);
# - pyarrow's Arrow Flight RPC libraries (pyarrow.flight: no core or parquet library links them);
# - sympy's compiled bytecode (sympy is imported only by torch.export and torch.compile, which then compile it);
# - pip and setuptools (nothing installs at run time; a derived image gets pip back with `python -m ensurepip`).
set -eu
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
find "$site" -mindepth 2 -type d -name tests -not -path "$site/torch/*" -prune -exec rm -rf {} +
rm -f "$site"/pyarrow/libarrow_flight.so* "$site"/pyarrow/_flight.*.so
find "$site/sympy" -type d -name __pycache__ -prune -exec rm -rf {} +
python -m pip uninstall -y -q pip setuptools
# what a run imports still imports
python -c 'import pyarrow.parquet, pyarrow.dataset, numpy, PIL, matplotlib, sympy, torch, torchvision, mlflow, optuna'
