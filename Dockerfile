FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY hyperpod_sim hyperpod_sim
RUN pip install --no-cache-dir '.[server]'

# On 0.0.0.0 serve needs credentials (HPSIM_AUTH__CREDENTIALS, docs/security.md); it refuses to
# start without them.
ENV HPSIM_HOST=0.0.0.0 \
    HPSIM_PORT=8080 \
    HPSIM_DATA_DIR=/data
# serve at 8080; `hyperpod-sim agent` at 9200 in compose and deploy/ (HyperPod's daemon port).
EXPOSE 8080 9200
VOLUME ["/data"]
ENTRYPOINT ["hyperpod-sim"]
CMD ["serve"]
