rule figures:
    input:
        unpack(peak_inputs),
        models=MODELS,
        activations=ACTIVATIONS,
        coefficients=COEFFICIENTS,
        validation=VALIDATION if HAVE_PEAKS else [],
    output:
        **{
            name: report(
                figure_path(name),
                caption=f"../report/{name}.rst",
                category="Figures",
            )
            for name in FIGURES
        },
    params:
        names=" ".join(FIGURES),
    log:
        "logs/figures.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/figures.tsv"
    shell:
        "python -m pipeline figures --results results --out results/figures --only {params.names}"
        " > {log:q} 2>&1"


rule dataset:
    input:
        unpack(peak_inputs),
        unpack(simulated_inputs),
        models=MODELS,
        activations=ACTIVATIONS,
        coefficients=COEFFICIENTS,
        validation=VALIDATION if HAVE_PEAKS else [],
        validation_summary=VALIDATION_SUMMARY if HAVE_PEAKS else [],
        figures=[figure_path(name) for name in FIGURES],
    output:
        card=DATASET_CARD,
    params:
        repo=config["publish_repo"],
    log:
        "logs/dataset.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/dataset.tsv"
    shell:
        "python -m pipeline dataset --results results --out results/dataset --repo {params.repo:q}"
        " > {log:q} 2>&1"


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
