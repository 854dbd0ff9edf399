"""LoRA export formats (diffusers, PEFT, ComfyUI, kohya, merged) and import back into our adapter."""

from diffpipe.export.api import ExportResult, export_lora
from diffpipe.export.diffusers_format import export_diffusers
from diffpipe.export.import_lora import ImportResult, import_lora

__all__ = ["ExportResult", "ImportResult", "export_diffusers", "export_lora", "import_lora"]
