# One image for every tokenrelay process: relay, worker, job worker (the installed wheel,
# `tokenrelay ...`), and, for the compose stack and the Kubernetes mock-engine component,
# the mock engine and the cluster's init (`python -m devstack engine|cluster form`: the
# development stack is not in the wheel, so its source is copied beside it, in /app).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY relay ./relay
COPY worker ./worker
COPY tokenrelay ./tokenrelay
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
WORKDIR /app
COPY --from=build /wheels /wheels
# server: the processes' HTTP stack; jobs: the worker's --amqp and the job worker;
# precise: KV events (and the mock engine's)
RUN pip install --no-cache-dir "$(echo /wheels/tokenrelay-*.whl)[server,jobs,precise]" && rm -rf /wheels
COPY devstack ./devstack
USER nobody
ENTRYPOINT ["tokenrelay"]
