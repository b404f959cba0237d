# The workflow: models.yaml -> configs -> activations -> (sweep -> aggregate | committed peaks)
#               -> (simulate_peaks | committed simulations) -> fit -> validate -> figures -> dataset -> publish.
# Each rule calls one stage of `python -m pipeline`; the stages do the work.
#   snakemake --cores 4                                   # everything, CPU-only machine
#   snakemake --cores 4 --config registry=tests/data/models_small.yaml
#   snakemake --cores 16 --config measure=gpu             # re-measure the peaks on a GPU
#   snakemake --profile profiles/slurm                    # measure on a SLURM cluster

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"


# `--resources gpu=1` (workflow profile) limits the GPU jobs of a local run; on a cluster each
# submitted job gets its own GPU, so the limit does not apply there.
resource_scopes:
    gpu="local",


# Light or networked stages stay on the submitting machine when a cluster executor is used.
localrules:
    all,
    configs,
    fit,
    validate,
    figures,
    dataset,
    publish,


report: "report/workflow.rst"


rule all:
    input:
        final_outputs(),
    default_target: True


include: "rules/configs.smk"
include: "rules/activations.smk"
include: "rules/sweep.smk"
include: "rules/simulate.smk"
include: "rules/fit.smk"
include: "rules/validate.smk"
include: "rules/figures.smk"
include: "rules/dataset.smk"
include: "rules/publish.smk"
