# Stage activations: hook counts and saved-for-backward bytes of every model on the meta device.

rule activations:
    input:
        registry=config["registry"],
        configs=CONFIGS,
    output:
        models=MODELS,
        activations=ACTIVATIONS,
    params:
        points=config["count_points"],
    log:
        "logs/activations.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/activations.tsv"
    threads: 8  # worker processes; Snakemake lowers it to --cores
    shell:
        "python -m pipeline activations --registry {input.registry:q} --configs {input.configs:q}"
        " --models-out {output.models:q} --activations-out {output.activations:q} --workers {threads}"
        " --points {params.points}"
        " > {log:q} 2>&1"
