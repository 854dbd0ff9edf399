"""The built-in families: one line each, name -> module.

Modules are imported on first use, so a cache or sample job pays only for
its own family's imports (all of them through diffusers cost seconds a job).
"""

FAMILY_MODULES: dict[str, str] = {
    "chroma": "diffpipe.models.chroma",
    "flux": "diffpipe.models.flux",
    "hidream": "diffpipe.models.hidream",
    "lumina2": "diffpipe.models.lumina2",
    "qwenimage": "diffpipe.models.qwenimage",
    "sd": "diffpipe.models.sd",
    "sd3": "diffpipe.models.sd3",
    "sdxl": "diffpipe.models.sdxl",
    "wan": "diffpipe.models.wan",
}
