// Strict reading of YAML config maps: every field is typed, unknown fields
// are errors, and every error names the field by its dotted path
// ("inputs.old_logp_noise", "references[1].impl"). A config that reads
// without error means exactly what it says; nothing is silently defaulted
// from a typo.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace grpo::bench {

// A config the tools refuse. field() is the dotted path of the offending
// field ("" for the file as a whole); what() is a full sentence with the file.
class ConfigError : public std::runtime_error {
 public:
  ConfigError(std::string field, const std::string& message, const std::string& source = "");
  const std::string& field() const { return field_; }
  const std::string& message() const { return message_; }
  const std::string& source() const { return source_; }

 private:
  std::string field_;
  std::string message_;
  std::string source_;
};

// Reads one YAML map. Each get*/require* call marks its key as known;
// finish() refuses any key that no call asked for.
class MapReader {
 public:
  // node must be a map (or null/absent when allow_missing, read as empty).
  MapReader(YAML::Node node, std::string path, bool allow_missing = false);

  const std::string& path() const { return path_; }
  bool has(const std::string& key) const;
  std::string field(const std::string& key) const;  // path_ + "." + key

  // Typed scalars. Optional: absent key -> nullopt (an explicit null is an error,
  // except where a getter says otherwise).
  std::optional<std::int64_t> get_int(const std::string& key);
  std::optional<double> get_double(const std::string& key);
  std::optional<bool> get_bool(const std::string& key);
  std::optional<std::string> get_string(const std::string& key);
  // A byte count: an integer, or a string with a KiB / MiB / GiB suffix.
  std::optional<std::uint64_t> get_bytes(const std::string& key);
  // One of the listed words; the error lists them.
  template <class E>
  std::optional<E> get_enum(const std::string& key, const std::vector<std::pair<std::string, E>>& values);

  template <class T>
  T require(const std::string& key, std::optional<T> (MapReader::*getter)(const std::string&)) {
    std::optional<T> v = (this->*getter)(key);
    if (!v) throw ConfigError(field(key), "is required");
    return *v;
  }

  // A nested map (absent -> empty reader when allow_missing).
  MapReader map(const std::string& key, bool allow_missing = true);
  // The raw node of a key (marks it known), for lists and custom handling.
  YAML::Node raw(const std::string& key);

  void finish() const;

 private:
  YAML::Node scalar(const std::string& key, const char* what);
  YAML::Node node_;
  std::string path_;
  std::set<std::string> seen_;
};

template <class E>
std::optional<E> MapReader::get_enum(const std::string& key, const std::vector<std::pair<std::string, E>>& values) {
  const std::optional<std::string> word = get_string(key);
  if (!word) return std::nullopt;
  std::string allowed;
  for (const auto& [name, value] : values) {
    if (name == *word) return value;
    allowed += (allowed.empty() ? "" : " | ") + name;
  }
  throw ConfigError(field(key), "is '" + *word + "', expected one of: " + allowed);
}

// Loads a YAML file; a parse error becomes a ConfigError naming the line.
YAML::Node load_yaml_file(const std::string& path);

// Applies a "a.b.c=value" override to a config tree (value parsed as YAML).
// Creates missing maps, so a misspelt key is still refused by the parser.
void apply_override(YAML::Node& root, const std::string& assignment);

// Deep merge: maps are merged key by key, anything else in `over` replaces.
YAML::Node merge_nodes(const YAML::Node& base, const YAML::Node& over);

}  // namespace grpo::bench
