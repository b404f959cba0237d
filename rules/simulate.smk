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
