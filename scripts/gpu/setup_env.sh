# Sourced first by the device-call scripts (the GPU machine has no network): install the carried
# cp312 wheels (.whl/, from ../shared/tools/device-wheels.sh) into /tmp/site and put them and the
# repository on PYTHONPATH; unbuffered logs; a Triton cache that lives as long as the machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
