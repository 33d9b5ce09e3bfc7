# The zerokl image the Helm chart runs (every service: `zerokl serve <service>`).
#   CPU:  docker build -t zerokl:dev .
#   CUDA: docker build -t zerokl:dev-cu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Not built in CI (no container runtime on the CI machines); the chart's tests check every
# container command line against the services' real argument parsers instead.
FROM python:3.11-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /opt/zerokl
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY kernels kernels
COPY services services
COPY protos protos
COPY zerokl zerokl
RUN pip install --no-cache-dir . && useradd --uid 10001 --no-create-home zerokl
USER 10001
ENTRYPOINT ["zerokl"]
