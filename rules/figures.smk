# Stage figures.

rule figures:
    input:
        unpack(peak_inputs),
        models=MODELS,
        activations=ACTIVATIONS,
        coefficients=COEFFICIENTS,
        validation=VALIDATION if HAVE_PEAKS else [],
        settings_validation=SETTINGS_VALIDATION if HAVE_SETTINGS else [],
        tables=[f"results/{name}" for name in FIGURE_TABLES if Path("results", name).exists()],
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
