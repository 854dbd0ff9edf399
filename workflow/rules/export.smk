# One output per configured format (and the one sample reads: dw.sample_format), plus the model card.
# params.formats is already a shell-quoted argument list (dw.export_format_args): no :q.


rule export:
    input:
        out(paths.ADAPTER_FILE),
    output:
        **dw.export_outputs(CFG),
    params:
        config=RESOLVED,
        formats=dw.export_format_args(CFG),
        digest=dw.stage_digest(CFG, "export"),
    log:
        out("logs/export.log"),
    benchmark:
        out("benchmarks/export.tsv")
    shell:
        "diffpipe export --config {params.config:q} {params.formats} > {log:q} 2>&1"
