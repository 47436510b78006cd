"""How the capture reaches into the user's code: the step loop found in a cell's (or a
function's) syntax tree (locate), rewritten so that its iterator and fetches go through the
hooks (rewrite; loops inside functions that earlier cells defined: cell_functions), the names
the rewritten code calls, kept in builtins (hooks), and a class's attributes replaced for the
cell's duration (patches). Pure, or undone in finally; imports nothing else of the capture."""
