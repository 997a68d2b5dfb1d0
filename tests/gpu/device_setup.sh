# Set up a machine with no package index for tests/gpu/run.sh; source it from the
# repository root: `. tests/gpu/device_setup.sh`. It installs the wheels carried in
# .whl/ (cudnn-frontend, lark, hypothesis, pytest-xdist, the build backend; fetched
# elsewhere with `pip download --no-deps --only-binary=:all: -d .whl ...`) into
# /tmp/site, then this project in editable mode, which builds the FFI extension.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-build-isolation --no-deps -e . || return 1
