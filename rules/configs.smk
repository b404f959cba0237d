# Stage configs: a transformers config per registry model (the Hub, else the embedded facts).
# A checkpoint: which models have a config decides the sweep's per-model jobs.

checkpoint configs:
    input:
        registry=config["registry"],
    output:
        configs=CONFIGS,
    params:
        source=config["config_source"],
    log:
        "logs/configs.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/configs.tsv"
    shell:
        "python -m pipeline configs --registry {input.registry:q} --out {output.configs:q}"
        " --source {params.source} > {log:q} 2>&1"
