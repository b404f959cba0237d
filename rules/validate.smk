# Stage validate: every estimator against every measured point.

rule validate:
    input:
        unpack(simulated_inputs),
        peaks=PEAKS,
        coefficients=COEFFICIENTS,
        configs=CONFIGS,
    output:
        validation=VALIDATION,
        summary=VALIDATION_SUMMARY,
        summary_json=VALIDATION_SUMMARY.replace(".md", ".json"),
        comparison="results/peak_comparison.md",
    params:
        exact=lambda wildcards, input: f"--simulated {input.simulated}" if "simulated" in input.keys() else "",
    log:
        "logs/validate.log",
    conda:
        "../envs/pipeline.yaml"
    benchmark:
        "logs/benchmarks/validate.tsv"
    shell:
        "python -m pipeline validate --peaks {input.peaks:q} --coefficients {input.coefficients:q}"
        " --configs {input.configs:q} --out {output.validation:q} --summary {output.summary:q}"
        " --comparison {output.comparison:q}"
        " {params.exact} > {log:q} 2>&1"
