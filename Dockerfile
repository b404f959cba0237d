# The web calculator (python -m pipeline serve) as a container: a Hugging Face Space with `sdk: docker`
# (space/README.md holds its front matter; docs/serve.md says how to push it) or any container host.
# CPU only: the exact method simulates on meta tensors, it needs no GPU.
FROM python:3.11-slim

RUN useradd --create-home --uid 1000 user
WORKDIR /home/user/app

# torch's CPU build first (the default wheel pulls several GB of CUDA libraries)
RUN pip install --no-cache-dir "torch>=2.11,<3" --index-url https://download.pytorch.org/whl/cpu

COPY --chown=user pyproject.toml README.md models.yaml ./
COPY --chown=user pipeline ./pipeline
# what the server reads: the coefficients, the configs stage's facts (the formula), the registry's
# counts (parameters, context length) and the validation summary (the accuracy shown per method)
COPY --chown=user results/coefficients.json results/configs.json results/models.parquet \
     results/validation_summary.json ./results/
# editable: the package finds models.yaml and results/ beside it (pipeline/core/paths.py)
RUN pip install --no-cache-dir -e .

USER user
ENV HOME=/home/user HF_HOME=/tmp/huggingface PYTHONUNBUFFERED=1
EXPOSE 7860
CMD ["python", "-m", "pipeline", "serve", "--host", "0.0.0.0", "--port", "7860"]
