"""The `--dry_run` flag of the commands (`oapl_jax.main`, `oapl_jax.sample`): `--dry_run` (or
`--dry_run=plan`) prints the memory plan; `--dry_run=compile` also compiles the programs for
the topology (oapl_jax/aot.py). JAX-free: the commands define their flags before JAX starts."""

from absl import flags


class DryRunParser(flags.ArgumentParser):
  """`--dry_run` (or `--dry_run=plan`): the memory plan; `--dry_run=compile`: every program
  compiled for the topology (oapl_jax/aot.py). A boolean flag, so that `--dry_run` alone works."""

  def parse(self, argument):
    value = str(argument).lower()
    if value in ("true", "1", "plan"):
      return "plan"
    if value in ("false", "0", "none"):
      return None
    if value == "compile":
      return "compile"
    raise ValueError(f"{argument!r}: use --dry_run (the plan) or --dry_run=compile")

  def flag_type(self):
    return "plan | compile"


def define(help_text: str, workdir_flag: str = "workdir"):
  """Defines `--dry_run` (`DryRunParser`) and makes `--<workdir_flag>` required unless it is
  given. Returns the flag holder ("plan", "compile" or None)."""
  holder = flags.DEFINE(DryRunParser(), "dry_run", None, help_text, boolean=True)
  flags.register_validator(workdir_flag, lambda v: v is not None or holder.value,
                           f"--{workdir_flag} is required (except with --dry_run)")
  return holder
