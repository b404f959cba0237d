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


# The training settings beyond the standard step (Trainer, amp-fp16, optimizers): their own tables.
rule validate_settings:
    input:
        tables=SETTINGS_PRESENT,
        simulated=SETTINGS_SIMULATED,
        coefficients=COEFFICIENTS,
        configs=CONFIGS,
    output:
        validation=SETTINGS_VALIDATION,
        summary=SETTINGS_SUMMARY,
    params:
        tables=lambda wildcards, input: " ".join(f"{path}={SETTINGS_TABLES[path]}" for path in input.tables),
    log:
        "logs/validate_settings.log",
    conda:
        "../envs/pipeline.yaml"
    shell:
        "python -m pipeline validate-settings --tables {params.tables} --coefficients {input.coefficients:q}"
        " --configs {input.configs:q} --simulated {input.simulated:q} --out {output.validation:q}"
        " --summary {output.summary:q} > {log:q} 2>&1"
