"""Pure planning: meshes, placements and placement rules, atoms and key maps, source layout
detection, selections, copy tasks and the dry-run text. Functions over metadata only: nothing
here reads tensor bytes or writes a file (``from_code`` runs the model's own code in a
subprocess to read placements, and returns them as data)."""
