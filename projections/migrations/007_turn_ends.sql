-- Where each turn's end (its first GenerationFinished or GenerationFailed) lies in its
-- chat.generations partition. A session's next prompt names its previous turn by its
-- prompt's and its end's offsets instead of repeating the history (schemas/history.py);
-- the gateway finds them here. NULL for turns stored before this column: the next turn
-- of such a session carries its history inline, once.
ALTER TABLE generations ADD COLUMN end_offset bigint;
