"""Developer tools behind `corral` sub-commands (model generation, ...)."""
