# Stage dataset: one parquet per subset and the dataset card.

rule dataset:
    input:
        unpack(peak_inputs),
        unpack(simulated_inputs),
        models=MODELS,
        activations=ACTIVATIONS,
        configs=CONFIGS,  # the features subset
        coefficients=COEFFICIENTS,
        validation=VALIDATION if HAVE_PEAKS else [],
        validation_summary=VALIDATION_SUMMARY if HAVE_PEAKS else [],
        figures=[figure_path(name) for name in FIGURES],
        settings=SETTINGS_PRESENT + [SETTINGS_VALIDATION] if HAVE_SETTINGS else [],
        layouts=[path for path in ["results/layouts/formula_vs_exact.parquet"] if Path(path).exists()],
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
