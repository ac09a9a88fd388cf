#!/bin/sh
# Run once the image's packages are installed: what a run never uses leaves the image, so that the CUDA image stays
# within torch plus 1 GB (docs/containers.md) with pyarrow (parquet) in it. Nothing here is imported by the job:
# - the packages' own test suites (directories named tests; `testing` modules, which some import, stay; torch is
#   left whole);
# - pyarrow's Arrow Flight RPC libraries (pyarrow.flight: no core or parquet library links them);
# - the compiled bytecode of packages a run imports only on a rarer path, which then compiles them as it imports:
#   sympy and networkx (torch.export and torch.compile), sqlalchemy (a sweep's study, an MLflow database),
#   databricks-sdk (a databricks:// tracking URI);
# - type stubs (.pyi) and C headers (include/): read by type checkers and compilers, never by Python at run time;
# - pip (nothing installs at run time; a derived image gets it back with `python -m ensurepip`). setuptools stays:
#   torch.compile's C++ builder imports it.
set -eu
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
find "$site" -mindepth 2 -type d -name tests -not -path "$site/torch/*" -prune -exec rm -rf {} +
rm -f "$site"/pyarrow/libarrow_flight.so* "$site"/pyarrow/_flight.*.so
for package in sympy networkx sqlalchemy databricks; do
    find "$site/$package" -type d -name __pycache__ -prune -exec rm -rf {} +
done
find "$site" -name '*.pyi' -not -path "$site/torch/*" -delete
rm -rf "$site/pyarrow/include" "$site/pyarrow/src" "$site/numpy/_core/include"
python -m pip uninstall -y -q pip
# what a run imports still imports
python -c 'import pyarrow.parquet, pyarrow.dataset, numpy, PIL, sympy, networkx, torch, torchvision'
python -c 'import mlflow, optuna, sqlalchemy, setuptools'
