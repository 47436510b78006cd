"""What the kernel holds, read (never changed): the IPython shell, its cell history, the user's
namespace and linecache; and the facts the checklist reads off them and the run."""
