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


rule count:
    input:
        registry=config["registry"],
        configs=CONFIGS,
    output:
        models=MODELS,
        activations=ACTIVATIONS,
    params:
        points=config["count_points"],
    log:
        "logs/count.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/count.tsv"
    threads: 8  # worker processes; Snakemake lowers it to --cores
    shell:
        "python -m pipeline activations --registry {input.registry:q} --configs {input.configs:q}"
        " --models-out {output.models:q} --activations-out {output.activations:q} --workers {threads}"
        " --points {params.points}"
        " > {log:q} 2>&1"
