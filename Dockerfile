# One image for every tokenrelay process: relay, worker, mock engine, cluster init.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY relay ./relay
COPY worker ./worker
COPY devstack ./devstack
COPY tokenrelay ./tokenrelay
COPY clients ./clients
COPY bench ./bench
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT ["tokenrelay"]
