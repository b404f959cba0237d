# Stage fit: the refit heuristic A = a*N + b and the closed-form activation formula from config
# facts, with their cross-validation -> coefficients.json (and the formula's comparison table).

rule fit:
    input:
        unpack(peak_inputs),
        models=MODELS,
        activations=ACTIVATIONS,
        configs=CONFIGS,
    output:
        coefficients=COEFFICIENTS,
        comparison="results/formula_comparison.md",
    params:
        peaks=lambda wildcards, input: f"--peaks {input.peaks}" if "peaks" in input.keys() else "",
    log:
        "logs/fit.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/fit.tsv"
    shell:
        "python -m pipeline fit --models {input.models:q} --activations {input.activations:q}"
        " --configs {input.configs:q} {params.peaks} --out {output.coefficients:q}"
        " --comparison {output.comparison:q} > {log:q} 2>&1"
