-- Lmod modulefile for hpcft. A site installs the checkout (or a pip prefix) under `root` and puts
-- this file on MODULEPATH; `module load hpcft` then gives `hpcft` and `import hpcft`.
help([[
hpcft 0.1.0 - fault-tolerant large-model training on Slurm with in-memory checkpointing.

  hpcft run --spares 2 -- python train.py     (inside an allocation)
  hpcft doctor                                (what this node offers)

Needs a Python with torch (your site's ROCm or CUDA build) set up before this module (`hpcft submit` writes
the site's lines from the config file's [site] table). Loads rocm and rccl-net-plugin where the site has them.
Documentation: $HPCFT_ROOT/README.md and $HPCFT_ROOT/docs/
]])

whatis("Name: hpcft")
whatis("Version: 0.1.0")
whatis("Description: Slurm job wrapper with in-memory checkpoints, spare nodes and requeue for PyTorch")
whatis("URL: docs in $HPCFT_ROOT/docs")

family("hpcft")

-- What hpcft needs from the site, declared as Lmod's "Dependent Modules" page advises: depends_on() loads a module
-- with hpcft and unloads it with hpcft unless another module needs it. RCCL needs its network plugin between nodes
-- (without it RCCL falls back to TCP sockets), and the plugin's module needs rocm loaded first (OLCF). A version the
-- user loaded already is kept; a site without these modules (a workstation, a CUDA cluster) loads nothing.
for _, name in ipairs({"rocm", "rccl-net-plugin"}) do
  if isloaded(name) or isAvail(name) then
    depends_on(name)
  end
end

-- The module sits at <root>/modules/hpcft/<version>.lua; a site may set HPCFT_INSTALL_ROOT instead.
-- A site that loads torch from a module of its own adds: prereq("<its python or pytorch module>")
local root = os.getenv("HPCFT_INSTALL_ROOT") or myFileName():match("(.*)/modules/hpcft/[^/]*$") or "/opt/hpcft"

setenv("HPCFT_ROOT", root)
prepend_path("PATH", pathJoin(root, "bin"))
prepend_path("PYTHONPATH", root)
