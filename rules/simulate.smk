# Stage simulate-peaks: the exact simulator at every measured point (simulate=run).

if SIMULATE == "run":

    rule simulate_peaks:
        input:
            peaks=PEAKS,
            configs=CONFIGS,
        output:
            simulated=SIMULATED,
        log:
            "logs/simulate_peaks.log",
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            "logs/benchmarks/simulate_peaks.tsv"
        threads: 8  # worker processes; Snakemake lowers it to --cores
        shell:
            "python -m pipeline simulate-peaks --peaks {input.peaks:q} --configs {input.configs:q}"
            " --out {output.simulated:q} --workers {threads} > {log:q} 2>&1"

    rule simulate_settings:
        input:
            tables=SETTINGS_PRESENT,
            configs=CONFIGS,
        output:
            simulated=SETTINGS_SIMULATED,
        log:
            "logs/simulate_settings.log",
        conda:
            "../envs/pipeline.yaml"
        params:
            tables=lambda wildcards, input: " ".join(f"{path}={SETTINGS_TABLES[path]}" for path in input.tables),
        shell:
            "python -m pipeline simulate-settings --tables {params.tables} --configs {input.configs:q}"
            " --out {output.simulated:q} > {log:q} 2>&1"
