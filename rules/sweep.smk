# Stage sweep (CUDA peaks), measure=gpu: one job per model of the sweep plan (its own processes, one GPU),
# then aggregate. The sweep keeps one resumable part file per (model, precision, attention) in
# results/peak_memory_parts/. measure=reuse: no rule here; the committed peak table is an input.

if MEASURE == "gpu":

    localrules:
        aggregate,

    rule sweep:
        input:
            plan=config["sweep_plan"],
            configs=CONFIGS,
        output:
            # The sweep's merged table after this model's job (every part in the folder).
            table="results/peak_memory_parts/{model}.parquet",
        params:
            model_id=model_id,
            parts=lambda wildcards, output: os.path.dirname(output.table),
            extra=config["measure_args"],
        log:
            "logs/sweep/{model}.log",
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            "logs/benchmarks/sweep/{model}.tsv"
        resources:
            gpu=1,
            mem_mb=64000,
            runtime=120,
        shell:
            "python -m pipeline sweep --plan {input.plan:q} --configs {input.configs:q}"
            " --parts {params.parts} --models {params.model_id:q} --out {output.table:q}"
            " {params.extra} > {log:q} 2>&1"

    rule aggregate:
        input:
            tables=measured_models,
        output:
            peaks=PEAKS,
        params:
            parts="results/peak_memory_parts",
        log:
            "logs/aggregate.log",
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            "logs/benchmarks/aggregate.tsv"
        shell:
            "python -m pipeline sweep --aggregate --parts {params.parts} --out {output.peaks:q}"
            " > {log:q} 2>&1"


# Several GPUs (issue 14): `snakemake --config measure=gpu distributed=true` on a machine (or a
# SLURM job) with several GPUs runs config/sweep_distributed.yaml, one torchrun job per group.
if DISTRIBUTED:

    rule sweep_distributed:
        input:
            plan="config/sweep_distributed.yaml",
            configs=CONFIGS,
        output:
            peaks="results/distributed/peak_memory.parquet",
        log:
            "logs/sweep_distributed.log",
        resources:
            gpu=8,
        shell:
            "python -m pipeline measure-distributed --plan {input.plan:q} --out {output.peaks:q} > {log:q} 2>&1"
