-- Where each accepted turn's prompt lies in its chat.prompts partition. A prompt is
-- void when another turn of its conversation was accepted between the point its history
-- was read and the prompt itself (schemas/conversation.py); the projector finds those
-- turns here.
ALTER TABLE generations ADD COLUMN prompt_offset bigint;
CREATE INDEX generations_by_prompt_offset ON generations (conversation_id, prompt_offset)
    WHERE prompt_offset IS NOT NULL;
