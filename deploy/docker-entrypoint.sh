#!/bin/sh
# The container's entrypoint: `pagedkv serve` on all interfaces of the container.
#
# The server binds 127.0.0.1 unless told otherwise, which inside a container is the container's own
# loopback in its own network namespace: `docker run -p` and a Kubernetes Service could not reach
# it. 0.0.0.0 binds the container's interfaces only, not the host's; what is published is still
# decided by -p or the Service.
#
# MODEL: a GGUF file or a Hugging Face folder inside the container (mount it, e.g. at /models);
# empty for the model baked into the image. PORT: the port to listen on (default 8000).
# PAGEDKV_API_KEY, when set, is the API key (pagedkv serve reads it itself).
# Arguments are passed on to `pagedkv serve` (e.g. --kv-offload-dir /var/cache/pagedkv/kv).
set -eu
if [ -n "${MODEL:-}" ]; then
    set -- "$MODEL" "$@"
fi
exec pagedkv serve --host 0.0.0.0 --port "${PORT:-8000}" "$@"
