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
        " {params.exact} > {log:q} 2>&1"


if SIMULATE == "run":

    rule simulate:
        input:
            peaks=PEAKS,
            configs=CONFIGS,
        output:
            simulated=SIMULATED,
        log:
            "logs/simulate.log",
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            "logs/benchmarks/simulate.tsv"
        threads: 8  # worker processes; Snakemake lowers it to --cores
        shell:
            "python -m pipeline simulate-peaks --peaks {input.peaks:q} --configs {input.configs:q}"
            " --out {output.simulated:q} --workers {threads} > {log:q} 2>&1"
