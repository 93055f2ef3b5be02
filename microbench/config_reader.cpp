#include "config_reader.hpp"

#include <cctype>

namespace grpo::bench {

ConfigError::ConfigError(std::string field, const std::string& message, const std::string& source)
    : std::runtime_error((source.empty() ? "" : source + ": ") + (field.empty() ? "" : "field '" + field + "' ") +
                         message),
      field_(std::move(field)),
      message_(message),
      source_(source) {}

namespace {

bool absent(const YAML::Node& node) { return !node.IsDefined() || node.IsNull(); }

}  // namespace

// yaml-cpp's Node::operator= writes through to the referenced node (and throws
// on the invalid node a missing key yields), so node_ is bound once, here.
MapReader::MapReader(YAML::Node node, std::string path, bool allow_missing)
    : node_(absent(node) ? YAML::Node(YAML::NodeType::Map) : node), path_(std::move(path)) {
  if (absent(node) && !allow_missing) throw ConfigError(path_, "is required");
  if (!node_.IsMap()) throw ConfigError(path_, "must be a map of fields");
}

std::string MapReader::field(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

bool MapReader::has(const std::string& key) const {
  const YAML::Node& n = node_;
  return static_cast<bool>(n[key]);
}

YAML::Node MapReader::scalar(const std::string& key, const char* what) {
  seen_.insert(key);
  const YAML::Node& n = node_;
  YAML::Node v = n[key];
  if (!v) return v;
  if (v.IsNull()) throw ConfigError(field(key), std::string("has no value (expected ") + what + ")");
  if (!v.IsScalar()) throw ConfigError(field(key), std::string("must be ") + what + ", not a list or map");
  return v;
}

std::optional<std::int64_t> MapReader::get_int(const std::string& key) {
  const YAML::Node v = scalar(key, "an integer");
  if (!v) return std::nullopt;
  try {
    return v.as<std::int64_t>();
  } catch (const YAML::Exception&) {
    throw ConfigError(field(key), "is '" + v.Scalar() + "', expected an integer");
  }
}

std::optional<double> MapReader::get_double(const std::string& key) {
  const YAML::Node v = scalar(key, "a number");
  if (!v) return std::nullopt;
  try {
    return v.as<double>();
  } catch (const YAML::Exception&) {
    throw ConfigError(field(key), "is '" + v.Scalar() + "', expected a number");
  }
}

std::optional<bool> MapReader::get_bool(const std::string& key) {
  const YAML::Node v = scalar(key, "true or false");
  if (!v) return std::nullopt;
  try {
    return v.as<bool>();
  } catch (const YAML::Exception&) {
    throw ConfigError(field(key), "is '" + v.Scalar() + "', expected true or false");
  }
}

std::optional<std::string> MapReader::get_string(const std::string& key) {
  const YAML::Node v = scalar(key, "a word");
  if (!v) return std::nullopt;
  return v.Scalar();
}

std::optional<std::uint64_t> MapReader::get_bytes(const std::string& key) {
  const YAML::Node v = scalar(key, "a byte count");
  if (!v) return std::nullopt;
  const std::string& s = v.Scalar();
  std::size_t digits = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits])) != 0) ++digits;
  const std::string suffix = s.substr(digits);
  std::uint64_t unit = 0;
  if (suffix.empty()) unit = 1;
  if (suffix == "KiB") unit = std::uint64_t{1} << 10;
  if (suffix == "MiB") unit = std::uint64_t{1} << 20;
  if (suffix == "GiB") unit = std::uint64_t{1} << 30;
  if (digits == 0 || digits > 15 || unit == 0) {
    throw ConfigError(field(key), "is '" + s + "', expected a byte count such as 268435456 or 256MiB");
  }
  return std::stoull(s.substr(0, digits)) * unit;
}

MapReader MapReader::map(const std::string& key, bool allow_missing) {
  seen_.insert(key);
  const YAML::Node& n = node_;
  return MapReader(n[key], field(key), allow_missing);
}

YAML::Node MapReader::raw(const std::string& key) {
  seen_.insert(key);
  const YAML::Node& n = node_;
  return n[key];
}

void MapReader::finish() const {
  for (const auto& kv : node_) {
    const std::string key = kv.first.Scalar();
    if (seen_.count(key) == 0) throw ConfigError(field(key), "is not a known field");
  }
}

YAML::Node load_yaml_file(const std::string& path) {
  try {
    return YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    throw ConfigError("", "cannot be read", path);
  } catch (const YAML::ParserException& e) {
    throw ConfigError("", "is not valid YAML: " + e.msg + " (line " + std::to_string(e.mark.line + 1) + ")", path);
  }
}

void apply_override(YAML::Node& root, const std::string& assignment) {
  const std::size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ConfigError("", "override '" + assignment + "' must look like key.path=value");
  }
  const std::string path = assignment.substr(0, eq);
  YAML::Node value;
  try {
    value = YAML::Load(assignment.substr(eq + 1));
  } catch (const YAML::ParserException& e) {
    throw ConfigError(path, "override value is not valid YAML: " + e.msg);
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  // Walk with fresh handles: yaml-cpp Node assignment rebinds, so each level
  // is re-fetched from its parent before being written.
  std::vector<std::string> keys;
  for (std::size_t at = 0;;) {
    const std::size_t dot = path.find('.', at);
    keys.push_back(path.substr(at, dot == std::string::npos ? std::string::npos : dot - at));
    if (dot == std::string::npos) break;
    at = dot + 1;
  }
  std::vector<YAML::Node> chain{root};
  for (std::size_t i = 0; i + 1 < keys.size(); ++i) {
    YAML::Node next = chain.back()[keys[i]];
    if (!next.IsMap()) {
      if (next.IsDefined() && !next.IsNull()) throw ConfigError(path, "override goes through a non-map field");
      chain.back()[keys[i]] = YAML::Node(YAML::NodeType::Map);
      next = chain.back()[keys[i]];
    }
    chain.push_back(next);
  }
  chain.back()[keys.back()] = value;
}

YAML::Node merge_nodes(const YAML::Node& base, const YAML::Node& over) {
  if (!over.IsDefined() || over.IsNull()) return YAML::Clone(base);
  if (!base.IsMap() || !over.IsMap()) return YAML::Clone(over);
  YAML::Node out = YAML::Clone(base);
  for (const auto& kv : over) {
    const std::string key = kv.first.Scalar();
    const YAML::Node& b = base;
    out[key] = b[key] ? merge_nodes(b[key], kv.second) : YAML::Clone(kv.second);
  }
  return out;
}

}  // namespace grpo::bench
