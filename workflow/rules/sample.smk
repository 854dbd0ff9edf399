rule sample:
    input:
        out(dw.EXPORT_OUTPUTS[dw.sample_format(CFG)]),
    output:
        report(
            directory(out(paths.SAMPLES_DIR)),
            patterns=["{name}.png"],
            caption="../report/samples.rst",
            category="Samples",
        ),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "sample"),
    # gpu: the pipeline samples on the GPU (sample.offload decides how much of it stays in CPU memory).
    resources:
        gpu=1,
    log:
        out("logs/sample.log"),
    benchmark:
        out("benchmarks/sample.tsv")
    shell:
        "diffpipe sample --config {params.config:q} > {log:q} 2>&1"
