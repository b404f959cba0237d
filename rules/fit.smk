# Stage fit: the refit heuristic and its cross-validation -> coefficients.json.

rule fit:
    input:
        unpack(peak_inputs),
        models=MODELS,
        activations=ACTIVATIONS,
    output:
        coefficients=COEFFICIENTS,
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
        " {params.peaks} --out {output.coefficients:q} > {log:q} 2>&1"
