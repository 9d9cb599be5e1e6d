// The chat template a command should use: --chat-template NAME, else the
// family detected from the model's tokenizer.chat_template metadata, else
// (no template in the file) gemma for a gemma3 model.
#pragma once

#include "cli/args.h"
#include "engine/engine.h"
#include "tokenizer/chat_template.h"

namespace kvstack::cli {

Result<ChatTemplate> chat_template_for(const Args& args, const Engine& engine);

}  // namespace kvstack::cli
