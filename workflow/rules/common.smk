# Shared by every rule: output locations and the checkpoint-aware shard lists.
# Logic lives in diffpipe.workflow / diffpipe.paths, where it is unit-tested.


wildcard_constraints:
    shard=r"s\d+",


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
    """A file the plan checkpoint writes (known only after it ran)."""

    def inputs(wildcards):
        checkpoints.plan.get()
        return out(template)

    return inputs
