"""The configuration as people read it: ``python train.py --help`` and the resolved config saved
beside a run (``job.save_config_file``)."""

from __future__ import annotations

import os

from torchtitan.config.schema import JobConfig, default_of, keys, sections, toml_value, type_name


def save_config(cfg: JobConfig) -> str:
    """``job.save_config_file`` under the dump folder: the resolved config as TOML; its path."""
    path = os.path.join(cfg.job.dump_folder, cfg.job.save_config_file)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(cfg.to_toml())
    return path


# ----------------------------------------------------------------------------- help


def help_text() -> str:
    out = [
        "usage: python train.py [--job.config_file FILE.toml] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "Precedence: defaults < TOML file < command line. Booleans: --a.b, --a.b=true|false.",
        "Lists: comma-separated (--model.converters a,b). Optional keys: 'none' unsets.",
        "",
    ]
    for section, cls in sections().items():
        out.append(f"[{section}]")
        for key, (f, tp) in keys(cls).items():
            default = default_of(f)
            shown = "unset" if default is None else toml_value(default)
            extra = ""
            if f.metadata.get("choices"):
                extra = f" {{{'|'.join(str(c) for c in f.metadata['choices'])}}}"
            out.append(f"  --{section}.{key}  ({type_name(tp)}, default {shown}){extra}")
            out.append(f"      {f.metadata.get('help', '')}")
        out.append("")
    return "\n".join(out)
