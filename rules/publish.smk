# Stage publish: upload the dataset and the coefficients (a dry run unless publish=true).

rule publish:
    input:
        card=DATASET_CARD,
        coefficients=COEFFICIENTS,
    output:
        manifest=PUBLISH_MANIFEST,
    params:
        repo=config["publish_repo"],
        dry_run="" if config["publish"] else "--dry-run",
    log:
        "logs/publish.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/publish.tsv"
    shell:
        "python -m pipeline publish --dataset results/dataset --coefficients {input.coefficients:q}"
        " --repo {params.repo:q} {params.dry_run} --manifest {output.manifest:q} > {log:q} 2>&1"
