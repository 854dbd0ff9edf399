# diffpipe workflow. Run it through the CLI:
#   diffpipe run --config config/demo.yaml
# or with Snakemake directly (from the repository root):
#   snakemake --configfile config/demo.yaml --profile profiles/default
from snakemake.utils import validate as validate_config

from diffpipe import paths
from diffpipe import workflow as dw

if not config:

    configfile: "config/demo.yaml"


validate_config(config, str(paths.SCHEMA_FILE))
# `snakemake --report report.zip` (or .html): Snakemake's own report of the rules' report() outputs.


report: "workflow/report/workflow.rst"

CFG = dw.load(config)
RESOLVED = dw.write_resolved_config(CFG)


include: "workflow/rules/common.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/sample.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/report.smk"


# The target rule only collects files: never a cluster job.
localrules:
    all,


rule all:
    input:
        dw.final_targets(CFG),
    default_target: True
