# Shared by every rule: output locations and the checkpoint-aware shard lists.
# Logic lives in diffpipe.workflow / diffpipe.paths, where it is unit-tested.


wildcard_constraints:
    shard=r"s\d+",
    vshard=r"v\d+",


def out(rel):
    return dw.out(CFG, rel)


def planned(template, kind):
    """Shard outputs of the plan checkpoint (known only after it ran)."""

    def inputs(wildcards):
        checkpoints.plan.get()
        names = paths.RunPaths(CFG.output_dir).shard_names(kind)
        return [out(template).format(shard=s) for s in names]

    return inputs


def plan_file(template):
    """A file the plan checkpoint writes (a shard spec: wildcards filled in).

    Asking the checkpoint (not naming the file) puts plan, and through it validate,
    in every DAG that needs a spec: `--target` on one shard after a caption edit
    replans first, and the shard reruns if its spec changed. A plain path inside the
    plan's directory() output has no producer for Snakemake: it was trusted as it was.
    """

    def inputs(wildcards):
        checkpoints.plan.get()
        return out(template.format(**wildcards))

    return inputs
